"""Operating a job: the embedded broker (:mod:`~coordinator.ops.broker`), enrolment,
certificates and the ACL (:mod:`~coordinator.ops.credentials`), the mosquitto files of
``fedbit broker-config`` (:mod:`~coordinator.ops.brokerconf`), who may send what
(:mod:`~coordinator.ops.admission`), logs and progress (:mod:`~coordinator.ops.logs`), the
ONNX export of a run (:mod:`~coordinator.ops.export`), where a run's files are
(:mod:`~coordinator.ops.rundir`), and watching a job: the live dashboard, Prometheus
metrics and ``fedbit status`` (:mod:`~coordinator.ops.dashboard`). See docs/security.md
and docs/operations.md.
"""
