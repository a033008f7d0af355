"""The committed-id set in bounded memory: ranges of derived ids, hashed ids, compact per-part lists."""
