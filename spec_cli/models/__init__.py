"""Models: where they come from (the hub, folders, GGUF files), how they are loaded and checked, profiles."""
