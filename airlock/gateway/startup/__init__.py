"""What makes a gateway's start quick: mitmproxy, the addon and aiohttp imported in a thread while the sandbox is
built (`preload`), with a short thread switch interval (`switching`) and no cycle collection (`collection`) meanwhile,
and without mitmproxy's default addons (`mitm`)."""
