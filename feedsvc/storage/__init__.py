"""Storage: the FeedStore interface and its two Redis drivers."""
