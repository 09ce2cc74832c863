"""Running handlers: execution of one delivery, the claim loop, the host and the sweeper."""
