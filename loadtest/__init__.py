"""Load generation, trace replay and simulation for kvroute."""
