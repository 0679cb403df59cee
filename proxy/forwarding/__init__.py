"""Sending a routed request to a backend and relaying its answer: the attempt and its
retries, the HTTP/1.1 client to the backends, assembling non-streamed answers from a
stream, which backends are healthy enough to send to, and the disk tier: slots saved to
files and restored (slot_tier.py, slot_store.py, slot_restore.py)."""
