from dapo.logs import quiet_native_logs

quiet_native_logs()  # before anything imports torch, which reads its C++ log level once (dapo.logs)

from tasks import flytekit_fixes  # noqa: E402 (after the log levels)

flytekit_fixes.register()
