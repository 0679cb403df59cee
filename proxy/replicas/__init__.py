"""Several kvroute replicas in front of the same backends, sharing what their requests
leave in the backends' slots through a NATS broker (see bus.py)."""
