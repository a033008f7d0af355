"""Process-level CPU tuning set before or around torch: OpenMP waiting, oneDNN caches, heap trimming, thread counts."""
