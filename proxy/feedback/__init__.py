"""What a backend's answer says about its cache (tokens reused, timings, slot), read
back into the router."""
