"""Reserved for the next issues; see ../shared/ARCHITECTURE.md §2 for what this folder owns."""
