"""What every layer stands on: errors, events, the hardware, the model families, paths, and the settings a
completion is decoded with."""
