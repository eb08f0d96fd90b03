"""What a trainer runs: the data, the micro-batch lifecycle with its retries and replays, routing over
replicas, the swarm view, and progress."""
