"""The HTTP layer: routes, handlers, validation and the one middleware (ids, errors, metrics)."""
