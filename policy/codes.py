"""Stable reason codes: the machine-readable twin of every decision's human `reason`.

Each audit line carries one as `code`, and the proxy's 403 body too. The text of a reason may change between
releases; a code never does (a new case gets a new code). docs/audit-codes.md says what each means.
"""

from __future__ import annotations

import enum


class ReasonCode(enum.StrEnum):
    # The policy core (decide, vet): what the rules and the address classifier say.
    ALLOWED = "allowed"  # a rule allows it (host or CIDR rule), and, for a name, a vetted address is left
    NOT_ALLOWLISTED = "not_allowlisted"  # no allow rule names the host or address
    PORT_NOT_ALLOWED = "port_not_allowed"  # an allow rule names the host, for other ports
    DENIED_BY_RULE = "denied_by_rule"
    ALIAS_DENIED = "alias_denied"  # the answer's CNAME chain passes through a name a deny rule closes
    METADATA = "metadata"  # cloud metadata / link-local: never reachable (Category.METADATA)
    INTERNAL_ADDRESS = "internal_address"  # internal and no CIDR rule opens it (Category.INTERNAL)
    OWN_ADDRESS = "own_address"  # one of the gateway's own addresses
    SANDBOX_LINK = "sandbox_link"  # a link airlock gives sandboxes: never an upstream
    NO_ADDRESS = "no_address"  # the name resolved to no address at all
    NO_ADDRESS_LEFT = "no_address_left"  # every address was refused, for different reasons
    NOT_A_NAME = "not_a_name"  # DNS was asked for an IP address as if it were a name
    SINGLE_LABEL = "single_label"  # a name of one label (`vm`): never resolved by the gateway, never allowed
    # Before any rule is consulted.
    UNKNOWN_SANDBOX = "unknown_sandbox"  # from an address no sandbox network covers
    INVALID_HOST = "invalid_host"  # not a host the gateway is willing to judge
    RESOLVE_FAILED = "resolve_failed"  # the upstream resolver failed or timed out
    # The proxy: what the request or tunnel itself does.
    CONNECTION_LIMIT = "connection_limit"
    TUNNEL_LIMIT = "tunnel_limit"
    REQUEST_IN_TUNNEL = "request_in_tunnel"
    MISSING_HOST_HEADER = "missing_host_header"
    HOST_MISMATCH = "host_mismatch"  # the Host header names another target (domain fronting)
    MALFORMED_CLIENT_HELLO = "malformed_client_hello"
    INVALID_SNI = "invalid_sni"
    SNI_MISMATCH = "sni_mismatch"  # the TLS SNI is not the CONNECT host (fronting)
    ECH = "ech"  # Encrypted Client Hello hides the real name, and the rule does not say `ech: true`
    NOT_TLS = "not_tls"  # a tunnel carries something else than TLS, and the rule does not say `tunnel: true`
    REQUEST_FAILED = "request_failed"  # allowed, then the exchange failed (upstream refused, timed out, reset)
    # Inspected hosts (`inspect: true`): what the request inside the terminated TLS asks, and the upstream's TLS.
    AMBIGUOUS_PATH = "ambiguous_path"  # a path spelled so that servers may read it apart (policy.paths)
    METHOD_NOT_ALLOWED = "method_not_allowed"  # an `http:` sub-rule names the path, for other methods
    PATH_NOT_ALLOWED = "path_not_allowed"  # no `http:` sub-rule of the rule names the path
    WEBSOCKET_NOT_ALLOWED = "websocket_not_allowed"  # a websocket upgrade where no sub-rule says `websocket: true`
    PLACEHOLDER_MISUSE = "placeholder_misuse"  # a secret's placeholder sent to a host whose rule does not inject it
    UPSTREAM_CERTIFICATE = "upstream_certificate"  # an inspected upstream's certificate is invalid: never passthrough
    # DNS: what the query itself asks.
    UNSUPPORTED_QUERY = "unsupported_query"  # not a standard query with exactly one question
    UNSUPPORTED_CLASS = "unsupported_class"  # a class other than IN
    SUSPICIOUS_NAME = "suspicious_name"  # exfiltration signals, refused where the profile says so
    TYPE_NOT_ANSWERED = "type_not_answered"  # an allowed name, asked for a type other than A/AAAA: empty answer
    NAME_NOT_FOUND = "name_not_found"  # an allowed name the upstream says does not exist (NXDOMAIN)
    INFLIGHT_LIMIT = "inflight_limit"  # too many of the sandbox's queries already wait on upstream
    # Approvals (`on_unlisted: ask`): a person decides what no rule lists (kind `approval`: the decision itself).
    APPROVED = "approved"  # a person approved it (the reason says who, with which scope)
    APPROVAL_DENIED = "approval_denied"  # a person denied it
    APPROVAL_TIMEOUT = "approval_timeout"  # nobody answered within the profile's ask_timeout
    APPROVAL_LIMIT = "approval_limit"  # too many requests already wait for a person: denied at once
    APPROVAL_PENDING = "approval_pending"  # DNS: the hold ended undecided (SERVFAIL); the request stays pending
    # The policy itself (kind `policy`): a reload put in force, or refused while the running policy stays.
    POLICY_LOADED = "policy_loaded"
    POLICY_REFUSED = "policy_refused"
    # Anything: a fault in airlock itself, answered as a denial (fail closed).
    AUDIT_UNAVAILABLE = "audit_unavailable"  # the audit log cannot be written: nothing is allowed until it can
    INTERNAL_ERROR = "internal_error"
