"""Offline stand-in for rules_cc's defs.bzl: the native C++ rules under their rules_cc names."""

# Each rule is looked up when called, so a rule this Bazel lacks fails only where it is used.

def cc_binary(**attrs):
    getattr(native, "cc_binary")(**attrs)

def cc_import(**attrs):
    getattr(native, "cc_import")(**attrs)

def cc_library(**attrs):
    getattr(native, "cc_library")(**attrs)

def cc_proto_library(**attrs):
    getattr(native, "cc_proto_library")(**attrs)

def cc_shared_library(**attrs):
    getattr(native, "cc_shared_library")(**attrs)

def cc_test(**attrs):
    getattr(native, "cc_test")(**attrs)

def cc_toolchain(**attrs):
    getattr(native, "cc_toolchain")(**attrs)

def cc_toolchain_suite(**attrs):
    getattr(native, "cc_toolchain_suite")(**attrs)

def fdo_prefetch_hints(**attrs):
    getattr(native, "fdo_prefetch_hints")(**attrs)

def fdo_profile(**attrs):
    getattr(native, "fdo_profile")(**attrs)

def objc_import(**attrs):
    getattr(native, "objc_import")(**attrs)

def objc_library(**attrs):
    getattr(native, "objc_library")(**attrs)
