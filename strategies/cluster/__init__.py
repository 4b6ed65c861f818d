"""Who a process is in its cluster: `TF_CONFIG`, discovery, membership, preemption."""
