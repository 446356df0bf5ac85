"""Operating a job: the embedded broker (:mod:`~coordinator.ops.broker`), enrolment,
certificates and the ACL (:mod:`~coordinator.ops.security`), who may send what
(:mod:`~coordinator.ops.admission`), logs and progress (:mod:`~coordinator.ops.logs`), and
the ONNX export of a run (:mod:`~coordinator.ops.export`). See docs/security.md.
"""
