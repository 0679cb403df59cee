"""The radix tree over token ids: which holder holds which prefix."""
