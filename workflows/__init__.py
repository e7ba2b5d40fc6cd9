from dapo.logs import quiet_native_logs

quiet_native_logs()  # before anything imports torch, which reads its C++ log level once (dapo.logs)
