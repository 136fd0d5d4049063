"""Hidden states: captured from the target at the capture layers (extract), stored as shards or computed online, read as training features."""
