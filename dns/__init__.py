"""The gateway's one DNS resolver (upstream client + cache), shared by the proxy and the DNS server."""
