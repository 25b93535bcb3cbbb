"""`airlock verify` and the fake internet it builds: network namespaces with a per-run prefix and no link to the
host's interfaces (`topology`), fake upstreams and a DNS upstream that count and log what reaches them (`fakenet`),
the throwaway CA their TLS is signed with (`ca`). The end-to-end tests build the same fake internet from here."""
