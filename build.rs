//! Compiles `proto/` with protox (pure Rust), so building needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/sentry_protos/taskbroker/v1/taskbroker.proto";
    println!("cargo:rerun-if-changed=proto");
    let descriptors = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Undecodable requests are INVALID_ARGUMENT, not INTERNAL.
        .codec_path("crate::grpc::codec::WireCodec")
        .compile_fds(descriptors)?;
    Ok(())
}
