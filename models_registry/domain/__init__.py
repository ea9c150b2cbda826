"""Pure rules for models and versions: identity, hashes, names, storage URIs, capacity."""
