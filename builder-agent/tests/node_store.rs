mod support_node;

use k8s_cri::v1::image_service_client::ImageServiceClient;
use kiln_agent::node::NodeStore;
use support_node::{Containerd, SavedImage};

#[tokio::test]
async fn explore() {
    let node = Containerd::start().await;
    let image = SavedImage::build(3 << 20);
    let store = node.store().await;
    node.ctr_import(&image.archive);
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let mut c = ImageServiceClient::new(node.channel().await);
    println!("{:#?}", c.list_images(k8s_cri::v1::ListImagesRequest { filter: None }).await.unwrap().into_inner());
    let cri = node.cri().await;
    println!("remove {:?}", cri.remove_ref(&image.id).await);
    println!("{:#?}", c.list_images(k8s_cri::v1::ListImagesRequest { filter: None }).await.unwrap().into_inner());
    let st = c
        .image_status(k8s_cri::v1::ImageStatusRequest {
            image: Some(k8s_cri::v1::ImageSpec { image: image.id.clone(), ..Default::default() }),
            verbose: true,
        })
        .await
        .unwrap()
        .into_inner();
    println!("{:#?}", st);
    println!("after {:#?}", store.list().await.unwrap());
}
