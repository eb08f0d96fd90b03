"""The swarm as seen through the DHT: signed, bounded records, bootstrap lists, run and stage choice."""
