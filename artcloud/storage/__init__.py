"""Where checkpoints live: the local layout with its manifests (checkpoints.py) and S3 (s3.py)."""
