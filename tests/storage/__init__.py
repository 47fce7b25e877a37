"""Tests of fastdata.storage: a local S3 server (moto), an HTTP range server and a throttling proxy."""
