"""What each request reports: what a backend's answer says about its cache (tokens
reused, timings, slot, the generated ids; outcome.py), which the attempt feeds back into
the router, and what the proxy records of the request (metrics, its log line, the status
page's recent decisions; recorder.py)."""
