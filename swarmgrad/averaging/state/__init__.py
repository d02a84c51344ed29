"""State transfer for joining peers: sharing (donor side), download (several donors, in
chunks), the chunk scheduler and the wire protocol."""
