"""DP ranks behind the router process: the router (sharding, waves, membership, stats), its
client, the rank process, the Ray launcher, the torchrun entry and the offline DP driver."""
