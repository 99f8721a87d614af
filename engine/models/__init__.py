"""Model implementations: ``config`` (``ModelArgs`` from config.json, no torch), ``llama`` (the decoder
family), ``registry`` (architecture -> class). Import the submodules directly."""
