"""What runs plans: the reads and writes of tensor bytes, the staging ring, the ranks' exchanges and
the bounds on waiting; no rule file, compile or plan is made here."""
