"""What each serving process runs over the storage interface for the api:
live followers' shared reads and the follow-and-wait loop (``live``), its
share of the projects' request rates (``rate_limiter``) and the mover of
dead-letter redrives (``redriver``). Above storage, below delivery and HTTP."""
