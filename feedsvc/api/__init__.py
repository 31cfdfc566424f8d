"""The HTTP layer: routes, handlers, validation and the error middleware."""
