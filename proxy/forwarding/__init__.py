"""Sending a routed request to a backend and relaying its answer: the attempt and its
retries, the HTTP/1.1 client to the backends, assembling non-streamed answers from a
stream, and which backends are healthy enough to send to."""
