"""Capture, from the spool to the ATDP document: the shipper (spool -> Interaction rows), the
sealed raw payloads (rawstore), the exchange -> step fields parser (steps) and the ATDP v1
document of a trajectory (atdp)."""
