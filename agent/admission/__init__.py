"""Admission: the ValidatingAdmissionPolicy that refuses, when a claim is made, opaque parameters the agent would
refuse at prepare, generated from the backends' configuration models."""
