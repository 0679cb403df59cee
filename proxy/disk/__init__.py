"""The disk tier: slots saved to files (llama-server --slot-save-path) and restored into
a backend of the same model, after a restart or for a request whose conversation only a
file holds. `DiskTier` (tier.py) has one `SlotStore` (store.py) per directory, composed of
the directory's files (files.py; their account, quarantine and index directory.py, what a
start keeps of them start.py, their records records.py), the files as the routers know
them (catalog.py), the model each backend runs (identity.py), the saves (save.py) and the
restores (restore.py).

What the router knows of the saved slots, and when restoring one is worth it, is the
routing core's (proxy/routing/disk.py, pure); `kv_disk:` and `slot_save_path:` are read
by proxy/config/disk.py.
"""
