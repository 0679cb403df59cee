"""The routing core: pure and synchronous, no I/O and no HTTP. What each backend's slots
and RAM tier hold (cache/), the radix tree of prefixes (tree/), the policy that picks a
backend and slot, the router that records decisions, queues and feedback, and the slots
saved to disk that a request may have restored first (disk.py)."""
