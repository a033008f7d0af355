"""Where output lives: local directories and object stores, their locks and leases, and the part writers."""
