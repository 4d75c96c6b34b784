"""Model blocks (one per file) operating on packed batches over paged caches."""
