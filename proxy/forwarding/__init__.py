"""Sending a routed request to a backend and relaying its answer: the attempt and its
retries, the HTTP/1.1 client to the backends, assembling non-streamed answers from a
stream, which backends are healthy enough to send to, and requests held for a slot. An
attempt has the disk tier (proxy/disk/) spill and restore the slot it was given."""
