"""The swarm-wide health page (``swarmpipe monitor``): every trusted run the DHT holds, read-only."""
