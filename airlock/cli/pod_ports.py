"""The ports of a sandbox pod's gateway sidecar (`airlock gateway --pod`), which the pod's fence (`airlock fence
--pod`) must name alike: both commands take their defaults from here, so the two agree with no port option given.

The proxy, transparent and broker ports are every gateway's defaults; a pod changes two: a sidecar that is not root
cannot bind port 53 (the fence redirects DNS to DNS_PORT), and its admin listener is a loopback port (the fence
refuses it to the agent). The broker relay (RELAY_PORT) is the agent's to dial, so the fence leaves it open.
"""

LISTEN = "127.0.0.1"  # where the fence redirects
PROXY_PORT = 3128
TRANSPARENT_PORT = 3129
DNS_PORT = 5353
RELAY_PORT = 8080
ADMIN_PORT = 8081
