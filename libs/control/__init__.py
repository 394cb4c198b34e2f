"""The control plane's shared pieces: conversions between contracts and the scheduling domain,
the folds of the members, schedule and replication streams (every service that reads a domain
folds it the same way), and a follower that replays a domain stream and keeps up with it."""
