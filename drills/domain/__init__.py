"""Pure drill machinery: the fleet simulator, workloads and the capacity plan.

Empty until the fleet-simulator issue; the layering rule already guards it.
"""
