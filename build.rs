//! Compiles `proto/` with protox (pure Rust), so building needs no system `protoc`,
//! and rebuilds when the embedded migrations change.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/sentry_protos/taskbroker/v1/taskbroker.proto";
    println!("cargo:rerun-if-changed=proto");
    // The migrations are embedded by `refinery::embed_migrations!`: a new
    // or changed file must rebuild the crate.
    println!("cargo:rerun-if-changed=migrations");
    let descriptors = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Undecodable requests are INVALID_ARGUMENT, not INTERNAL.
        .codec_path("crate::grpc::codec::WireCodec")
        .compile_fds(descriptors)?;
    Ok(())
}
