"""Who a request is: bearer tokens and their scopes (``access``), JWTs and the
issuer's keys (``jwt_keys``), OpenStack Keystone tokens (``keystone``).
Below storage and HTTP alike: the api checks a request with it
(``feedsvc.api.identity``), the admin API its own token."""
