"""The disk tier: slots saved to files (llama-server --slot-save-path) and restored into
a backend of the same model, after a restart or for a request whose conversation only a
file holds. `DiskTier` (tier.py) has one `SlotStore` (store.py, its restores restore.py)
per directory; a directory's files, their records and what a start keeps of them are
files.py, records.py and start.py; the model a file was computed by is identity.py.

What the router knows of the saved slots, and when restoring one is worth it, is the
routing core's (proxy/routing/disk.py, pure); `kv_disk:` and `slot_save_path:` are read
by proxy/config/disk.py.
"""
