"""What a volunteer peer runs: the stage runtime (weights, stash, optimizer, compute thread), the gRPC
server, batching, state export/import and transfer, replica averaging, rebalancing, and the daemon
with its lifecycle."""
