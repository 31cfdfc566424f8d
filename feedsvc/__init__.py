"""feedsvc: a fast, correct Zaqar-v2-compatible message feed on Redis."""

__version__ = "0.1.0"
