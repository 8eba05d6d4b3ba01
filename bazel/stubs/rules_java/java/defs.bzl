"""Offline stand-in for rules_java's defs.bzl: the native Java rules under their rules_java names."""

# Each rule is looked up when called, so a rule this Bazel lacks fails only where it is used.

def java_binary(**attrs):
    getattr(native, "java_binary")(**attrs)

def java_import(**attrs):
    getattr(native, "java_import")(**attrs)

def java_library(**attrs):
    getattr(native, "java_library")(**attrs)

def java_lite_proto_library(**attrs):
    getattr(native, "java_lite_proto_library")(**attrs)

def java_package_configuration(**attrs):
    getattr(native, "java_package_configuration")(**attrs)

def java_plugin(**attrs):
    getattr(native, "java_plugin")(**attrs)

def java_proto_library(**attrs):
    getattr(native, "java_proto_library")(**attrs)

def java_runtime(**attrs):
    getattr(native, "java_runtime")(**attrs)

def java_test(**attrs):
    getattr(native, "java_test")(**attrs)

def java_toolchain(**attrs):
    getattr(native, "java_toolchain")(**attrs)
