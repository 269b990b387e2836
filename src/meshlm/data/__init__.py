"""Data at scale: readers, streaming parallel tokenization into sharded caches, blends, inspection."""
