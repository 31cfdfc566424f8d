"""Load tests for feedsvc: the Locust users, the no-miss checker and the
lua-vs-watch comparison runner (``python -m loadtest compare``)."""
