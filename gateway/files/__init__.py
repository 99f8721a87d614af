"""Files (``/v1/files``): uploads for the batch tier and the batch outputs, in a storage backend."""
